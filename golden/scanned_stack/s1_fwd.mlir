module @jit_s1_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<2x16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg2: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<8x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<2x16x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<2x8x16xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %1 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<2x8x16xf32>
    %cst_1 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<2x8x16xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %3:6 = stablehlo.while(%iterArg = %arg1, %iterArg_8 = %c, %iterArg_9 = %arg0, %iterArg_10 = %0, %iterArg_11 = %1, %iterArg_12 = %2) : tensor<2x16x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>
    cond {
      %c_13 = stablehlo.constant dense<2> : tensor<i32>
      %15 = stablehlo.compare LT, %iterArg_8, %c_13, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %15 : tensor<i1>
    } do {
      %15 = func.call @dynamic_index_in_dim(%iterArg, %iterArg_8) : (tensor<2x16x16xf32>, tensor<i32>) -> tensor<16x16xf32>
      %16:4 = func.call @closed_call(%iterArg_9, %15) : (tensor<8x16xf32>, tensor<16x16xf32>) -> (tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>)
      %17 = func.call @dynamic_update_index_in_dim(%iterArg_10, %16#1, %iterArg_8) : (tensor<2x8x16xf32>, tensor<8x16xf32>, tensor<i32>) -> tensor<2x8x16xf32>
      %18 = func.call @dynamic_update_index_in_dim(%iterArg_11, %16#2, %iterArg_8) : (tensor<2x8x16xf32>, tensor<8x16xf32>, tensor<i32>) -> tensor<2x8x16xf32>
      %19 = func.call @dynamic_update_index_in_dim(%iterArg_12, %16#3, %iterArg_8) : (tensor<2x8x16xf32>, tensor<8x16xf32>, tensor<i32>) -> tensor<2x8x16xf32>
      %c_13 = stablehlo.constant dense<1> : tensor<i32>
      %20 = stablehlo.add %iterArg_8, %c_13 : tensor<i32>
      stablehlo.return %iterArg, %20, %16#0, %17, %18, %19 : tensor<2x16x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>
    }
    %4 = stablehlo.subtract %3#2, %arg2 : tensor<8x16xf32>
    %cst_2 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst_2, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %6 = stablehlo.multiply %5, %4 : tensor<8x16xf32>
    %cst_3 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_4 = stablehlo.constant dense<1.280000e+02> : tensor<f32>
    %7 = stablehlo.divide %cst_3, %cst_4 : tensor<f32>
    %8 = stablehlo.broadcast_in_dim %7, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %9 = stablehlo.multiply %8, %6 : tensor<8x16xf32>
    %cst_5 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %10 = stablehlo.broadcast_in_dim %cst_5, dims = [] : (tensor<f32>) -> tensor<2x16x16xf32>
    %c_6 = stablehlo.constant dense<0> : tensor<i32>
    %11:7 = stablehlo.while(%iterArg = %arg1, %iterArg_8 = %3#3, %iterArg_9 = %3#4, %iterArg_10 = %3#5, %iterArg_11 = %c_6, %iterArg_12 = %9, %iterArg_13 = %10) : tensor<2x16x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x16x16xf32>
    cond {
      %c_14 = stablehlo.constant dense<2> : tensor<i32>
      %15 = stablehlo.compare LT, %iterArg_11, %c_14, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %15 : tensor<i1>
    } do {
      %c_14 = stablehlo.constant dense<2> : tensor<i32>
      %15 = stablehlo.subtract %c_14, %iterArg_11 : tensor<i32>
      %c_15 = stablehlo.constant dense<1> : tensor<i32>
      %16 = stablehlo.subtract %15, %c_15 : tensor<i32>
      %17 = func.call @dynamic_index_in_dim(%iterArg, %16) : (tensor<2x16x16xf32>, tensor<i32>) -> tensor<16x16xf32>
      %18 = func.call @dynamic_index_in_dim_0(%iterArg_8, %16) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %19 = func.call @dynamic_index_in_dim_0(%iterArg_9, %16) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %20 = func.call @dynamic_index_in_dim_0(%iterArg_10, %16) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %21:2 = func.call @closed_call_1(%iterArg_12, %17, %18, %19, %20) : (tensor<8x16xf32>, tensor<16x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<16x16xf32>)
      %22 = func.call @dynamic_update_index_in_dim_2(%iterArg_13, %21#1, %16) : (tensor<2x16x16xf32>, tensor<16x16xf32>, tensor<i32>) -> tensor<2x16x16xf32>
      %c_16 = stablehlo.constant dense<1> : tensor<i32>
      %23 = stablehlo.add %iterArg_11, %c_16 : tensor<i32>
      stablehlo.return %iterArg, %iterArg_8, %iterArg_9, %iterArg_10, %23, %21#0, %22 : tensor<2x16x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x16x16xf32>
    }
    %cst_7 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %12 = stablehlo.broadcast_in_dim %cst_7, dims = [] : (tensor<f32>) -> tensor<2x16x16xf32>
    %13 = stablehlo.multiply %12, %11#6 : tensor<2x16x16xf32>
    %14 = stablehlo.subtract %arg1, %13 : tensor<2x16x16xf32>
    return %11#5, %14 : tensor<8x16xf32>, tensor<2x16x16xf32>
  }
  func.func private @dynamic_index_in_dim(%arg0: tensor<2x16x16xf32>, %arg1: tensor<i32>) -> tensor<16x16xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 16, 16] : (tensor<2x16x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x16x16xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x16x16xf32>) -> tensor<16x16xf32>
    return %1 : tensor<16x16xf32>
  }
  func.func private @closed_call(%arg0: tensor<8x16xf32>, %arg1: tensor<16x16xf32>) -> (tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    %1 = stablehlo.tanh %0 : tensor<8x16xf32>
    %cst = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %3 = stablehlo.subtract %2, %1 : tensor<8x16xf32>
    return %1, %arg0, %1, %3 : tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>
  }
  func.func private @dynamic_update_index_in_dim(%arg0: tensor<2x8x16xf32>, %arg1: tensor<8x16xf32>, %arg2: tensor<i32>) -> tensor<2x8x16xf32> {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [1, 2] : (tensor<8x16xf32>) -> tensor<1x8x16xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_update_slice %arg0, %0, %arg2, %c, %c_0 : (tensor<2x8x16xf32>, tensor<1x8x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<2x8x16xf32>
    return %1 : tensor<2x8x16xf32>
  }
  func.func private @dynamic_index_in_dim_0(%arg0: tensor<2x8x16xf32>, %arg1: tensor<i32>) -> tensor<8x16xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 8, 16] : (tensor<2x8x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x8x16xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x8x16xf32>) -> tensor<8x16xf32>
    return %1 : tensor<8x16xf32>
  }
  func.func private @closed_call_1(%arg0: tensor<8x16xf32>, %arg1: tensor<16x16xf32>, %arg2: tensor<8x16xf32>, %arg3: tensor<8x16xf32>, %arg4: tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<16x16xf32>) {
    %0 = stablehlo.multiply %arg0, %arg4 : tensor<8x16xf32>
    %1 = stablehlo.multiply %0, %arg3 : tensor<8x16xf32>
    %2 = stablehlo.add %0, %1 : tensor<8x16xf32>
    %3 = stablehlo.dot_general %2, %arg2, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
    %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %5 = stablehlo.dot_general %2, %arg1, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    return %5, %4 : tensor<8x16xf32>, tensor<16x16xf32>
  }
  func.func private @dynamic_update_index_in_dim_2(%arg0: tensor<2x16x16xf32>, %arg1: tensor<16x16xf32>, %arg2: tensor<i32>) -> tensor<2x16x16xf32> {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [1, 2] : (tensor<16x16xf32>) -> tensor<1x16x16xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_update_slice %arg0, %0, %arg2, %c, %c_0 : (tensor<2x16x16xf32>, tensor<1x16x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<2x16x16xf32>
    return %1 : tensor<2x16x16xf32>
  }
}
